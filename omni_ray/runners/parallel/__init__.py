"""One request on several ranks: the gang's mesh and collectives, sequence-parallel attention (Ulysses, ring),
tensor-parallel sharding, and the DiT runner's split of a step over them."""
