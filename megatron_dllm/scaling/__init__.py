"""Scaling-law tooling: FLOPs accounting, IsoFLOP planning, fits, Pareto frontier and plots."""
