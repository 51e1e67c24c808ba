"""The supervisor side's low kit: what the supervisor, launch, validator, integrations and the rollout
workers' watcher share, below all of them.

Secret masking (`redact`), bounded reads of files a user can hand us (`bounded`), children in their own
process groups with their output logged and scanned (`process`), the GPU inventory, record and health rule
(`gpu`), the failure kinds (`failures`), the run lock and process record (`ownership`), the event log
(`events`), the one shape of what a watcher saw (`observe`) and the environment a job's processes get
(`environment`). Torch-free; imports only the bottom layer and `config/`.
"""
