"""``pipeline.<schedule>.*``: stages through ``PipelineStage`` and torch's
schedules: the path (``path``) and what each rank runs (``rank``)."""
