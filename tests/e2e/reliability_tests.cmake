# Reliability (docs/RELIABILITY.md): training across hosts, a killed rank (also in a pipeline),
# a cut link, a full and a read-only disk. Included by tests/e2e/CMakeLists.txt. Every script needs root: it
# creates network namespaces or mounts file systems, and fails (never skips) without them.
# Each runs its own short tsp=2 trainings of configs/tiny.json and sets its own watchdog
# timeout where the test is about it; 60 s elsewhere, so a hang fails instead of stalling.
set(FOLDPAR_RELIABILITY_TESTS
  multihost_train     multihost.sh     # tsp=2 and dp=2,tsp=2 over two hosts == one host
  fault_killed_rank   faults_kill.sh   # SIGKILL mid-step: the job ends, names rank and host; resume
  fault_killed_pipeline_rank faults_kill_pipeline.sh  # the same under pp=2,tsp=2; resume there and as tsp=2
  fault_cut_link      faults_link.sh   # a host's link down: same, across hosts
  disk_full_read_only disk_faults.sh)  # ENOSPC and EROFS: exit 3, previous checkpoint intact; resume
while(FOLDPAR_RELIABILITY_TESTS)
  list(POP_FRONT FOLDPAR_RELIABILITY_TESTS name script)
  add_test(NAME e2e.${name} COMMAND bash ${E2E}/${script} ${MPIEXEC_EXECUTABLE} ${FOLDPAR_BIN} ${PROJECT_SOURCE_DIR})
  set_tests_properties(e2e.${name} PROPERTIES LABELS "e2e;reliability" TIMEOUT 300 PROCESSORS 2 COST 18
                       ENVIRONMENT "OPENBLAS_NUM_THREADS=1;FOLDPAR_COMM_TIMEOUT=60")
endwhile()
