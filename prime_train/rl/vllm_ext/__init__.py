"""Code that runs inside vLLM's own processes: this directory goes on their PYTHONPATH (rl/vllm_server.py).

It holds `prime_train_vllm.py` and nothing that imports prime-train, which vLLM's environment does not have.
"""
