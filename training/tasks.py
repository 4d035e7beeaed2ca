from celery import shared_task

from training.models import Rollout
from training.rollouts import rollout_tick


@shared_task(name="training.tasks.tick_rollouts", ignore_result=True, time_limit=120, soft_time_limit=100)
def tick_rollouts() -> dict:
    """Advance every running rollout one step (guards, soak, next phase). Safe to run twice at once."""
    outcomes: dict[str, int] = {}
    for rollout in Rollout.objects.filter(state=Rollout.State.RUNNING).select_related("version__adapter"):
        outcome = rollout_tick(rollout=rollout)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    return outcomes
