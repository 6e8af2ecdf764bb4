"""Running lightning_oobleck under SLURM.

* :mod:`lightning_oobleck.slurm.config`: :class:`~lightning_oobleck.slurm.config.SubmitConfig`, the
  ``submit:`` section of a training config;
* :mod:`lightning_oobleck.slurm.submit`: ``submit`` / ``wait`` / ``collect`` with submitit;
* :mod:`lightning_oobleck.slurm.rendezvous`: the job's rendezvous store and recovery coordinator on the
  batch host;
* :mod:`lightning_oobleck.slurm.cluster`: what SLURM's commands say.

Nothing is imported here: the rendezvous store and the submitted tasks import only what they use (a task
start must not pay for Lightning's import). The sbatch template and the scripts for a local test cluster are
in the repository's ``slurm/`` folder.
"""
