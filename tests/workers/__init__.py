"""Scripts the tests run as ranks (by path, under hpcring run, srun, mpirun or blaunch)."""
