# foldpar generate: identical generations across layouts and ranks, Hugging Face input, stop
# sequences, streaming and input errors (tests/e2e/generate.sh).
add_test(NAME e2e.generate COMMAND bash ${E2E}/generate.sh ${MPIEXEC_EXECUTABLE} ${FOLDPAR_BIN} ${PROJECT_SOURCE_DIR})
set_tests_properties(e2e.generate PROPERTIES LABELS e2e TIMEOUT 600 COST 32
                     ENVIRONMENT "OPENBLAS_NUM_THREADS=1;FOLDPAR_COMM_TIMEOUT=60")
