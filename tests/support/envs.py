"""Fake launcher environments, one per launcher as a rank of it sees them: what the tests of
``runtime.launch.env.discover`` feed it (with ``use_mpi=False``: never MPI_Init inside
pytest), in this process or in a child that imports them from here."""

TORCHRUN_ENV = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
                "TORCHELASTIC_RUN_ID": "none"}
SRUN_ENV = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "7",
            "SLURM_STEP_NUM_TASKS": "7", "SLURM_NODEID": "2", "SLURM_STEP_ID": "0",
            "SLURM_JOB_ID": "1234", "SLURM_STEP_TASKS_PER_NODE": "2(x3),1",
            "SLURM_STEP_NODELIST": "gpu[07-10]", "SLURM_NNODES": "4"}
OMPI_ENV = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            "OMPI_MCA_ess_base_jobid": "2136997889", "PMIX_NAMESPACE": "2136997889",
            "PMIX_RANK": "1", "OMPI_MCA_orte_jobfam_session_dir": "/tmp/ompi.vm.0/pid.5022"}
MPICH_ENV = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
             "PMI_FD": "9", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "23456"}
