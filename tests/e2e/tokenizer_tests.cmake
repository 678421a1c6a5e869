# tokenizer.json through the program (tests/e2e/tokenizer_json.sh): refusals exit 2 with one
# line; a real file prepares a corpus (skipped without the npm files).
add_test(NAME e2e.tokenizer_json COMMAND bash ${E2E}/tokenizer_json.sh ${FOLDPAR_BIN} ${PROJECT_SOURCE_DIR})
set_tests_properties(e2e.tokenizer_json PROPERTIES LABELS e2e TIMEOUT 300 SKIP_RETURN_CODE 77)
