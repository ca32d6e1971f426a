"""Cluster launchers: a recipe and its overrides -> a ready-to-submit job (``olmax launch``).

- :mod:`olmax.launch.slurm`: an ``sbatch`` script, one process per node through ``srun``;
- :mod:`olmax.launch.k8s`: an Indexed Job + headless Service manifest (GPU pods or TPU slices);
- :mod:`olmax.launch.tpu`: TPU accelerator types and the TPU VM script (``gcloud ... ssh --worker=all``);
- :mod:`olmax.launch.job`: what they share (validation, the training command, the atomic write).

Every process runs the same ``olmax train RECIPE --run-dir DIR key=value ...``; how processes find
each other is :mod:`olmax.parallel.distributed`'s business, not the launcher's.
"""
