# Files other tools read and write (issue 21): GGUF export held to llama.cpp (skipped
# without @fugood/llama.node), pre-tokenized .bin/.npy input to prepare-data, and the
# published configs of configs/ with today's verdict on each.
add_test(NAME e2e.gguf_export COMMAND bash ${E2E}/gguf_export.sh ${FOLDPAR_BIN} ${PROJECT_SOURCE_DIR})
set_tests_properties(e2e.gguf_export PROPERTIES LABELS e2e TIMEOUT 300 SKIP_RETURN_CODE 77 COST 17)
add_test(NAME e2e.pretokenized_data COMMAND bash ${E2E}/pretokenized_data.sh ${FOLDPAR_BIN} ${PROJECT_SOURCE_DIR})
set_tests_properties(e2e.pretokenized_data PROPERTIES LABELS e2e TIMEOUT 300)
add_test(NAME e2e.real_configs COMMAND bash ${E2E}/real_configs.sh ${FOLDPAR_BIN} ${PROJECT_SOURCE_DIR})
set_tests_properties(e2e.real_configs PROPERTIES LABELS e2e TIMEOUT 120)
