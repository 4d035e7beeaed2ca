from celery import shared_task

from accounts.services import api_tokens_purge_expired


@shared_task(name="accounts.tasks.purge_expired_api_tokens", ignore_result=True, time_limit=120)
def purge_expired_api_tokens() -> int:
    return api_tokens_purge_expired()
