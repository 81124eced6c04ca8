"""``mesh.*``: two-dimensional device meshes ("dp" x "tp", 2 x 2) on a
4-rank process group: FSDP2 over "dp" composed with tensor parallelism over
"tp" (``mesh.fsdp_tp.*``), and DTensor parameters placed on both mesh dims
(``mesh.dtensor2d.*``); and pipeline x data parallel on a ("pp", "dp")
mesh of the same ranks (``mesh.pp_dp.*``). The paths (``path``), what each
rank runs (``rank``, ``pp_dp``), the case data and draws (``data``,
``strategy``)."""

from harness.paths.family import Family, lazy
from harness.paths.mesh.data import CASE_DATA

FAMILY = Family(
    "mesh",
    paths=lazy("harness.paths.mesh.paths:paths"),
    canaries=lazy("harness.paths.mesh.canaries:canaries"),
    case_data=CASE_DATA,
    docs="harness/paths/mesh/README.md",
    prefixes=("mesh",),
    components={"mesh": "DTensor"},
    machinery=("torch.distributed.tensor", "torch.distributed.device_mesh", "torch.distributed.fsdp",
               "torch.distributed.pipelining"),
    probe_data=lambda cut: {"version": 1, "codes": [], "partial_dp": False, "schedule": "", "wrapper": "ddp"},
)
