"""The speculation core: the draft contract, verification, sampling, goodput, logprobs."""
