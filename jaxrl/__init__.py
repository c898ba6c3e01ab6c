"""jaxrl: on-policy RL post-training of LLMs on sharded JAX meshes."""
