"""Training learned drafters (draft heads) for a target model on CPU or GPU."""
