"""``dtensor.*``: parameters as DTensors on a real process group: the path
(``path``), what each rank runs (``rank``) and collective counting
(``collectives``)."""
