import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("agents", "0003_revision_triggers")]

    operations = [
        migrations.CreateModel(
            name="McpToolList",
            fields=[
                (
                    "agent",
                    models.OneToOneField(
                        on_delete=django.db.models.deletion.CASCADE,
                        primary_key=True,
                        related_name="mcp_tool_list",
                        serialize=False,
                        to="agents.agent",
                    ),
                ),
                ("revision", models.DateTimeField(help_text="The agent's updated_at these tools were listed for.")),
                ("tools", models.JSONField(blank=True, default=list)),
                ("problems", models.JSONField(blank=True, default=dict)),
                ("listed_at", models.DateTimeField(auto_now=True)),
            ],
        ),
    ]
