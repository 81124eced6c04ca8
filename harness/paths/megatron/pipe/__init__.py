"""megatron-core's pipeline schedules, the family's second machinery: what
each rank of ``megatron.pp.*`` and ``megatron.vpp.*`` runs and their
standalone script (the paths themselves are in ``megatron/paths.py``)."""
