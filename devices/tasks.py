from celery import shared_task

from core.live import LiveEvent, publish
from devices import presence
from devices.models import Device

# Above this many transitions in one flush, the dashboard gets one summary instead of an event each.
LIVE_EVENT_BATCH = 50


@shared_task(name="devices.tasks.flush_presence", ignore_result=True, time_limit=60, soft_time_limit=50)
def flush_presence() -> dict:
    result = presence.flush_presence()
    transitions = [("device.online", d) for d in result.came_online] + [
        ("device.offline", d) for d in result.went_offline
    ]
    if len(transitions) > LIVE_EVENT_BATCH:
        publish(
            LiveEvent(
                kind="fleet.presence",
                data={
                    "online": result.seen,
                    "came_online": len(result.came_online),
                    "went_offline": len(result.went_offline),
                },
            )
        )
    elif transitions:
        ids = {device_id for _, device_id in transitions}
        names = {str(pk): name for pk, name in Device.objects.filter(pk__in=ids).values_list("pk", "name")}
        for kind, device_id in transitions:
            publish(LiveEvent(kind=kind, data={"device": device_id, "name": names.get(str(device_id))}))
    return {"online": result.seen, "came_online": len(result.came_online), "went_offline": len(result.went_offline)}
