"""Side-by-side measurements of the engine, each writing a report (run as ``python -m benchmarks.X``)."""
