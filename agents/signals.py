"""A change to an agent's options or server tools is a change to the agent: its
`updated_at` moves, so every process's cached definition (selectors.agent_definition) is
read again on the next turn."""

from django.db.models.signals import post_delete, post_save
from django.dispatch import receiver
from django.utils import timezone

from .models import Agent, AgentOption, ServerTool


@receiver(post_save, sender=AgentOption)
@receiver(post_delete, sender=AgentOption)
@receiver(post_save, sender=ServerTool)
@receiver(post_delete, sender=ServerTool)
def _touch_agent(sender, instance, **kwargs):
    Agent.objects.filter(pk=instance.agent_id).update(updated_at=timezone.now())
