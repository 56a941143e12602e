//! The controller layer, end to end on a real control plane and real Valkey: every controller
//! behaviour (docs/internals/controller.md), `targetlease run` and `wait`, and the chaos runs with their
//! independent checker. One binary, one suite after the other, each starting the control plane
//! it needs only when one of its trials is selected (`cargo test --test controller -- run::`).

mod chaos;
mod lifecycle;
mod run;

fn main() {
    targetlease_test_support::suite::layer(
        "controller",
        &[
            ("controller", lifecycle::suite),
            ("run", run::suite),
            ("chaos", chaos::suite),
        ],
    )
}
