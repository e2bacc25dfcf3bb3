"""Tensor parallelism: one server's served layers over the GPUs of a pod (or CPU processes), Megatron-style.

* `shard`: what each rank holds (its heads and MLP columns of every layer) and how partial sums combine;
* `group`: how the ranks start, connect and run collectives that time out;
* `ops`: the operations rank 0 sends;
* `driver`: rank 0, where everything a client talks to stays, driving the others;
* `worker`: ranks > 0.
"""
