"""DeepSpeed's pipeline engine, the family's second machinery: its paths
(``deepspeed.pipe.*``), what each rank runs, its standalone script and the
cut into two stages both of them read."""
