"""Data-parallel paths: DDP and FSDP2 on the worker pool's process group."""
