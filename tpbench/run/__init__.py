"""How a run happens: configs composed and checked (compose), a torchrun job and its workers
(launch, worker; batch: consecutive runs on warm workers; faults: injected failures), many runs
recorded (sweep) and Slurm jobs (slurm)."""
