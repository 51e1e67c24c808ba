"""The supervisor side's low kit: what the supervisor, launch, validator, integrations and the rollout
workers' watcher share, below all of them.

Secret masking (`redact`), bounded reads of files a user can hand us (`bounded`), children in their own
process groups with their output logged and scanned (`process`), the GPU inventory, record and health rule
(`gpu`), the failure kinds (`failures`), the run lock and process record (`ownership`) and the event log
(`events`). Torch-free; imports only the bottom layer and `config/`.
"""
