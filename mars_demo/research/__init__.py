"""Research tooling on top of the engine: training data, MARS fine-tuning, evaluation, benchmarks and reports."""
