// The independent linearizability checker of tests/store/linearizability.rs (Porcupine).
module targetlease.invalid/tests/porcupine

go 1.26.0

require github.com/anishathalye/porcupine v1.3.1
