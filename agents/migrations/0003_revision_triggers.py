"""Every change to an agent row, its options or its server tools moves the agent's
`updated_at`, in the database itself: the workers' cached definitions are keyed on it
(selectors.agent_definition), so a raw UPDATE that leaves `updated_at` alone (say, one that
sets `unsafeWithoutSandbox` and reverts it) must not leave a worker with a stale definition.
PostgreSQL only: the embedded mode (SQLite) is one process whose writes go through the ORM."""

from django.db import migrations

FORWARD = """
CREATE OR REPLACE FUNCTION agents_agent_revision() RETURNS trigger AS $$
BEGIN
    IF ROW(NEW.*) IS DISTINCT FROM ROW(OLD.*) THEN
        NEW.updated_at := GREATEST(clock_timestamp(), OLD.updated_at + interval '1 microsecond');
    END IF;
    RETURN NEW;
END
$$ LANGUAGE plpgsql;

CREATE OR REPLACE FUNCTION agents_agent_child_revision() RETURNS trigger AS $$
DECLARE
    agent bigint;
BEGIN
    IF TG_OP = 'DELETE' THEN
        agent := OLD.agent_id;
    ELSE
        agent := NEW.agent_id;
    END IF;
    UPDATE agents_agent SET updated_at = clock_timestamp() WHERE id = agent;
    IF TG_OP = 'UPDATE' AND OLD.agent_id IS DISTINCT FROM NEW.agent_id THEN
        UPDATE agents_agent SET updated_at = clock_timestamp() WHERE id = OLD.agent_id;
    END IF;
    RETURN NULL;
END
$$ LANGUAGE plpgsql;

DROP TRIGGER IF EXISTS agents_agent_revision ON agents_agent;
CREATE TRIGGER agents_agent_revision BEFORE UPDATE ON agents_agent
    FOR EACH ROW EXECUTE FUNCTION agents_agent_revision();
DROP TRIGGER IF EXISTS agents_agentoption_revision ON agents_agentoption;
CREATE TRIGGER agents_agentoption_revision AFTER INSERT OR UPDATE OR DELETE ON agents_agentoption
    FOR EACH ROW EXECUTE FUNCTION agents_agent_child_revision();
DROP TRIGGER IF EXISTS agents_servertool_revision ON agents_servertool;
CREATE TRIGGER agents_servertool_revision AFTER INSERT OR UPDATE OR DELETE ON agents_servertool
    FOR EACH ROW EXECUTE FUNCTION agents_agent_child_revision();
"""

BACKWARD = """
DROP TRIGGER IF EXISTS agents_servertool_revision ON agents_servertool;
DROP TRIGGER IF EXISTS agents_agentoption_revision ON agents_agentoption;
DROP TRIGGER IF EXISTS agents_agent_revision ON agents_agent;
DROP FUNCTION IF EXISTS agents_agent_child_revision();
DROP FUNCTION IF EXISTS agents_agent_revision();
"""


def forward(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(FORWARD, None)


def backward(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(BACKWARD, None)


class Migration(migrations.Migration):
    dependencies = [("agents", "0002_capability_toggles")]

    operations = [migrations.RunPython(forward, backward)]
