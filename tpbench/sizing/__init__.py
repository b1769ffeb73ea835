"""Made from checked configs, above both halves (predict/ and run/): the search for a model's TP
layouts on a GPU (fit) and a run's time here before it launches (estimate)."""
