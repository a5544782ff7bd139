//! The proxy's memory under load: the node-wide budget for buffered tunnel bytes (`BUFFER_BUDGET_MIB`,
//! `BUFFER_BUDGET_PER_POD_MIB`, enforced by [`hbone::budget`]) and its metrics.
//!
//! The defaults hold a node's proxy well under 200 MiB whatever one pod does: one pod holds at most
//! [`DEFAULT_PER_POD_MIB`] of tunnel bytes, all pods together [`DEFAULT_BUDGET_MIB`], on top of the proxy's
//! fixed cost per connection (BENCHMARKS.md, `hostile-buffers`). A pod's share is four times the 4 MiB HTTP/2
//! stream window (`hbone::settings`), so one bulk transfer never waits on the budget.

use hbone::MemoryBudget;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

/// `BUFFER_BUDGET_MIB` by default.
pub const DEFAULT_BUDGET_MIB: usize = 64;
/// `BUFFER_BUDGET_PER_POD_MIB` by default.
pub const DEFAULT_PER_POD_MIB: usize = 16;

/// A budget of `budget_mib` for the node (0: off) and `per_pod_mib` for each pod.
pub fn budget(budget_mib: usize, per_pod_mib: usize) -> MemoryBudget {
    MemoryBudget::new(budget_mib << 20, per_pod_mib << 20)
}

/// Exports the budget, a pod's share and the bytes held now (read at each scrape).
pub fn register(registry: &mut Registry, budget: &MemoryBudget) {
    registry.register_collector(Box::new(BudgetCollector(budget.clone())));
}

#[derive(Debug)]
struct BudgetCollector(MemoryBudget);

impl Collector for BudgetCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let gauges = [
            ("hbone_buffer_budget_bytes", "Node-wide budget for buffered tunnel bytes; 0: off", self.0.limit()),
            ("hbone_buffer_budget_per_pod_bytes", "What one pod may hold of the buffer budget", self.0.share()),
            ("hbone_buffer_held_bytes", "Tunnel bytes held in user space now, all pods", self.0.held()),
        ];
        for (name, help, value) in gauges {
            let gauge = ConstGauge::new(value as i64);
            let metric = encoder.encode_descriptor(name, help, None, gauge.metric_type())?;
            gauge.encode(metric)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_and_what_is_held_are_exported() {
        let budget = MemoryBudget::new(64 << 20, 16 << 20);
        let mut registry = Registry::default();
        register(&mut registry, &budget);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(text.contains("hbone_buffer_budget_bytes 67108864"), "{text}");
        assert!(text.contains("hbone_buffer_budget_per_pod_bytes 16777216"), "{text}");
        assert!(text.contains("hbone_buffer_held_bytes 0"), "{text}");
    }
}
