"""Bundle distribution: each worker's signed bundle, served plain, by long-poll or as a stream of changes."""
