"""What is sent to the engine and what is reported about it: request traces, arrival times,
seeded synthetic workloads, and the summaries, pool reports and plots of a run."""
