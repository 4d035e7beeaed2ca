"""The dashboard's reads: each returns what one page shows, in a fixed number of queries.

Every function here runs the same number of queries whatever the row counts (tests/frontend pin that), so a
page never slips into one query per device, delta or version. Lists are cut to a page or a stated limit.

The reads live by page: ``common`` (page sizes, the per-row count subquery, pagination), ``overview``, ``fleet``
(devices, cohorts, tokens) and ``training`` (models, adapters, rounds, rollouts); callers use this package.
"""

from devices.selectors import device_list  # the device page's rows, which devices.filters narrows
from frontend.selectors.common import (
    CHARTED_METRICS,
    DELTAS_PER_PAGE,
    DEVICES_PER_PAGE,
    LINEAGE_LIMIT,
    RECENT_ACTIVITY,
    ROLLOUTS_PER_PAGE,
    ROUNDS_PER_PAGE,
    VERSION_CHOICES_LIMIT,
    paginate,
)
from frontend.selectors.fleet import (
    DeviceDetail,
    cohort_list,
    device_detail,
    enrollment_token_list,
    version_choices,
)
from frontend.selectors.overview import (
    Activity,
    CohortVersions,
    RejectedDeltas,
    data_span,
    deltas_per_hour,
    device_counts,
    recent_activity,
    rejected_deltas,
    rounds_in_progress,
    shared_accuracy,
    versions_in_use,
)
from frontend.selectors.personalization import (
    DevicePersonal,
    adapter_personalization,
    device_personalization,
    personalization_headlines,
)
from frontend.selectors.release import Notice, ReleaseState, release_states
from frontend.selectors.training import (
    AdapterDetail,
    LineageRow,
    RolloutDetail,
    RolloutPhase,
    RoundDetail,
    adapter_detail,
    adapter_list,
    adapters_for_rounds,
    base_model_list,
    metric_series,
    rollout_detail,
    rollout_list,
    rollout_versions,
    round_detail,
    round_list,
    version_lineage,
    with_device_counts,
)

__all__ = [
    "Notice",
    "ReleaseState",
    "release_states",
    "Activity",
    "AdapterDetail",
    "CHARTED_METRICS",
    "CohortVersions",
    "DELTAS_PER_PAGE",
    "DEVICES_PER_PAGE",
    "DeviceDetail",
    "DevicePersonal",
    "LINEAGE_LIMIT",
    "LineageRow",
    "RECENT_ACTIVITY",
    "ROLLOUTS_PER_PAGE",
    "ROUNDS_PER_PAGE",
    "RejectedDeltas",
    "RolloutDetail",
    "RolloutPhase",
    "RoundDetail",
    "VERSION_CHOICES_LIMIT",
    "adapter_detail",
    "adapter_list",
    "adapter_personalization",
    "adapters_for_rounds",
    "base_model_list",
    "cohort_list",
    "data_span",
    "deltas_per_hour",
    "device_counts",
    "device_detail",
    "device_list",
    "device_personalization",
    "enrollment_token_list",
    "metric_series",
    "paginate",
    "personalization_headlines",
    "recent_activity",
    "rejected_deltas",
    "rollout_detail",
    "rollout_list",
    "rollout_versions",
    "round_detail",
    "round_list",
    "rounds_in_progress",
    "shared_accuracy",
    "version_choices",
    "version_lineage",
    "versions_in_use",
    "with_device_counts",
]
