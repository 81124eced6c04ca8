"""torchtitan's tensor-parallel Llama, the family's second machinery: the
``torchtitan.tp.stock`` path and what each of its ranks runs."""
