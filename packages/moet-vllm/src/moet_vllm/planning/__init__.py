"""Planning a pool before serving: routing traces and the policies replayed over them
(`moet plan`). Not what the server runs (that is moet_vllm.residency); this answers "how many
slots, and what would they cost" from a trace of what a model routed.

- :mod:`.traces`: the routing-trace format (.npy + JSON sidecar), coverage curves, seeded
  synthetic traces shaped like real models' routing.
- :mod:`.simulate`: the trace-driven simulator: LRU, LFU, decayed frequency (the serving
  policy), Belady's offline policies, and a provable lower bound on replay steps.
"""
