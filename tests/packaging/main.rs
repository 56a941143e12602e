//! What a platform team installs, tested as it is installed: the Helm chart without a cluster
//! and on the local control plane, the controller image, the release kit, the chart and the
//! examples on a node that runs pods, and upgrades from the previous release on a node. One
//! binary, one suite after the other (`cargo test --test packaging -- node::`).

mod chart;
mod chart_cluster;
mod image;
mod node;
mod release;
mod upgrade_node;

fn main() {
    targetlease_test_support::suite::layer(
        "packaging",
        &[
            ("chart", chart::suite),
            ("chart-cluster", chart_cluster::suite),
            ("image", image::suite),
            ("release", release::suite),
            ("node", node::suite),
            ("upgrade-node", upgrade_node::suite),
        ],
    )
}
