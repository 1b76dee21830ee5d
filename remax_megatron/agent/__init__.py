"""agent: tools and the sandbox for model-written code."""
