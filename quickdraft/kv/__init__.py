"""K/V memory: the batched cache and the prefix cache."""
