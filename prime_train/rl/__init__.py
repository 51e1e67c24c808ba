"""RL in one package: environments, token budgets, rollout workers and their supervision, and the GRPO job.

Two halves (docs/architecture.md): torch-free modules the supervisor, lint and preflight import
(environments, budget, workers, client, rollouts, vllm_server's argv), and the training side that
runs in the job's processes (grpo, train, generation, worker).
"""
