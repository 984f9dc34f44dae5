//! Memory planner: each device's peak bytes for meta-training and for editing, estimated
//! from a model's `config.json` and a MEND configuration before anything is loaded.
//!
//! The estimate follows what the code does, item by item: frozen weights (main), the
//! sub-device replica (when split), the editor with its gradients and Adam moments (f32,
//! main), captured factors, the edit (its low-rank factors in training and for f32
//! weights, the edited weights `W'` otherwise) and its copy on the sub-device, the activations autograd keeps
//! for the edited forwards, logits at labelled positions.
//!
//! Items are grouped by *when* they are alive. `resident` items live for the whole run;
//! every other group is alive only during its part of a step (gradient capture, the edited
//! forwards, their backward, the optimiser step, a checkpoint write), and those parts do
//! not overlap. A device's peak is therefore `resident + max over the other groups`.
//!
//! Activations are counted by simulating which tensors each op saves for backward: a
//! matmul saves its input only when its weight requires grad (an edited weight, or the
//! factor `a` of a factored edit, whose `x·aᵀ` saves the same input), a norm
//! saves its input only when that input requires grad, and so on. Nothing below the first
//! edited weight requires grad, so the frozen layers below it keep no activations at all.
mod advice;
pub mod data;
mod items;
mod judge;
mod plan;
mod placement;
mod render;
mod sizes;
mod types;
mod request;
pub mod verdict;

pub use advice::*;
pub use placement::*;
pub use request::PlanRequest;
pub use types::*;

#[cfg(test)]
mod tests {
    use super::sizes::{saved_activations, Saved};
    use super::*;
    use crate::config::MendConfig;
    use crate::model::gpt2::{Gpt2, Gpt2Config};
    use crate::model::Model;
    use tch::Kind;

    fn gpt2(n_layer: i64, d: i64, v: i64) -> Model {
        let c: Gpt2Config = serde_json::from_value(serde_json::json!({
            "vocab_size": v, "n_embd": d, "n_layer": n_layer, "n_head": 4, "n_positions": 128
        }))
        .unwrap();
        Model::new(Gpt2::new(c).unwrap())
    }

    #[test]
    fn frozen_layers_below_the_first_edit_keep_nothing() {
        let m = gpt2(6, 64, 100);
        let last: Vec<(i64, String)> = vec![(5, "mlp.c_fc".into()), (5, "mlp.c_proj".into())];
        let two: Vec<(i64, String)> = vec![(4, "mlp.c_fc".into()), (5, "mlp.c_fc".into()), (5, "mlp.c_proj".into())];
        let Saved { per_token: a, per_layer: la } = saved_activations(m.family(), 4, &last);
        let Saved { per_token: b, per_layer: lb, .. } = saved_activations(m.family(), 4, &two);
        assert_eq!(la.len(), 1);
        assert_eq!(lb.len(), 2);
        assert!(b > a);
        // Layer 5: ln_2 input not needed (residual has no grad), c_fc input + gelu in/out.
        assert_eq!(la[0].1, (64 + 2 * 256) * 4);
    }

    #[test]
    fn plan_sums_and_split() {
        let m = gpt2(4, 64, 100);
        let cfg = MendConfig { rank: 8, ..MendConfig::default() };
        let single = plan_model(&m, &cfg, &PlanOptions::new("cpu", None, Kind::Float, 16, Some(4)).unwrap()).unwrap();
        assert_eq!(single.totals.len(), 2); // one device, two phases
        let t = &single.totals[0];
        assert_eq!(t.roles, vec!["main", "sub"]);
        let resident = t.by_group[&Group::Resident];
        let largest = t.by_group.iter().filter(|(g, _)| **g != Group::Resident).map(|(_, b)| *b).max().unwrap();
        assert_eq!(t.peak_bytes, resident + largest);
        assert_eq!(t.by_group[&t.peak_group], largest);
        let split = plan_model(&m, &cfg, &PlanOptions::new("cuda:0", Some("cuda:1"), Kind::BFloat16, 16, Some(4)).unwrap()).unwrap();
        assert_eq!(split.totals.len(), 4);
        let sub_train = split.peak("cuda:1", Phase::Train);
        let weights = (m.info().n_params * 2) as u64;
        assert!(sub_train > weights, "the sub-device holds the replica and the edited forwards");
        // Editor state stays on main.
        assert!(split.group_bytes("cuda:0", Phase::Train, Group::Resident) > weights + 4 * single.shape.editor_parameters as u64);
        // Training losses are computed on the sub-device: no vocabulary-sized tensor of the
        // edited forwards is planned on main, and only the edit phase copies logits back.
        let logits_of = |p: &MemoryPlan, phase: Phase| -> Vec<Role> {
            p.items.iter().filter(|i| i.phase == phase && i.item.starts_with("logits")).map(|i| i.role).collect()
        };
        assert_eq!(logits_of(&split, Phase::Train), vec![Role::Sub]);
        assert_eq!(logits_of(&single, Phase::Train), vec![Role::Main]);
        assert!(logits_of(&split, Phase::Edit).contains(&Role::Main));
        assert!(split.table().contains("PEAK cuda:1 (sub)"));
        assert!(serde_json::to_string(&split).unwrap().contains("\"peak_bytes\""));
    }

    #[test]
    fn recompute_keeps_block_inputs_instead_of_activations() {
        let m = gpt2(12, 64, 100);
        let deep: Vec<String> = [2, 5, 8, 11].iter().flat_map(|l| ["c_fc", "c_proj"].map(|x| format!("transformer.h.{l}.mlp.{x}.weight"))).collect();
        let o = PlanOptions::new("cpu", None, Kind::Float, 128, Some(8)).unwrap();
        let plain = MendConfig { rank: 8, batch_size: 4, edit_params: deep, ..MendConfig::default() };
        let rc = MendConfig { recompute: true, ..plain.clone() };
        let (a, b) = (plan_model(&m, &plain, &o).unwrap(), plan_model(&m, &rc, &o).unwrap());
        let fwd = |p: &MemoryPlan| p.group_bytes("cpu", Phase::Train, Group::EditedForward);
        assert!(fwd(&b) < fwd(&a), "recompute {} vs {}", fwd(&b), fwd(&a));
        // Capture and editing are untouched.
        assert_eq!(a.group_bytes("cpu", Phase::Train, Group::Capture), b.group_bytes("cpu", Phase::Train, Group::Capture));
        assert_eq!(a.peak("cpu", Phase::Edit), b.peak("cpu", Phase::Edit));
        // Block inputs of blocks 2..11 plus the last hidden state: 11 · B·T·d·4.
        let inputs = b.items.iter().find(|i| i.item.starts_with("recompute: block inputs")).unwrap();
        assert_eq!(inputs.bytes, 11 * 4 * 128 * 64 * 4);
        assert!(!b.items.iter().any(|i| i.item.starts_with("edited forwards: activations")));
        // Split: the W' leaves and the gradient sum on sub, one copy each.
        let mut os = o.clone();
        os.split = true;
        let split = plan_model(&m, &rc, &os).unwrap();
        assert!(split.items.iter().any(|i| i.role == Role::Sub && i.item.contains("W' leaves on sub")));
        assert!(!split.items.iter().any(|i| i.phase == Phase::Train && i.item.contains("W' copy on sub (one edited forward)")));
    }

    #[test]
    fn bad_options_are_refused() {
        assert!(PlanOptions::new("gpu", None, Kind::Float, 8, None).is_err());
        let m = gpt2(3, 64, 100);
        // Beyond the context: capped as runs cap max_length.
        let o = PlanOptions::new("cpu", None, Kind::Float, 1000, None).unwrap();
        assert_eq!(plan_model(&m, &MendConfig::default(), &o).unwrap().shape.tokens_per_example, 128);
        let o = PlanOptions::new("cpu", None, Kind::Float, 8, Some(8)).unwrap();
        assert!(plan_model(&m, &MendConfig::default(), &o).is_err());
        let o = PlanOptions::new("cpu", None, Kind::Float, 8, None).unwrap();
        let bad = MendConfig { edit_params: vec!["transformer.wte.weight".into()], ..MendConfig::default() };
        assert!(plan_model(&m, &bad, &o).is_err());
    }
}
