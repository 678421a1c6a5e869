# TP x SP (the 2-D mesh tp=T,sp=S_, parallel/tpsp/): parity with the single-rank model (loss,
# logits, every gradient and ParamRef; both K/V exchanges, zigzag and contiguous, GQA and MHA,
# tied and untied, recompute, sequence parallelism, loss normalizers), errors, and the
# traffic per layer and per step on each communicator against the written formulas.
# Layouts by world size: np 1 tp=1,sp=1; np 2 tp=2,sp=1 and tp=1,sp=2; np 4 tp=2,sp=2.
foldpar_mpi_test_program(tpsp_parity_test)
foldpar_mpi_test(tpsp_parity_test RANKS 1 2 4)
foldpar_mpi_test_program(tpsp_traffic_test)
foldpar_mpi_test(tpsp_traffic_test RANKS 1 2 4)
# Checking mode must pass a correct schedule: on both communicators every rank issues the
# same collectives in the same order.
foldpar_mpi_test(tpsp_parity_test RANKS 4 SUFFIX .checked ENV FOLDPAR_COMM_CHECK=1)
