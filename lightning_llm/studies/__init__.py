"""Studies: experiment drivers that train a model and measure a method on it (shared by tests, tutorials and
benchmarks). They sit above the modules they train with, never inside a feature package."""
