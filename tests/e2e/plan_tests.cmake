# foldpar plan and foldpar bench --layouts (src/plan, src/app/layout_bench.h): the plan's
# table and JSON, input errors, and a 2-rank layout bench writing its tables and plots.
add_test(NAME e2e.plan COMMAND bash ${E2E}/plan.sh ${MPIEXEC_EXECUTABLE} ${FOLDPAR_BIN} ${PROJECT_SOURCE_DIR})
set_tests_properties(e2e.plan PROPERTIES LABELS e2e TIMEOUT 300 COST 40
                     ENVIRONMENT "OPENBLAS_NUM_THREADS=1;FOLDPAR_COMM_TIMEOUT=60")
