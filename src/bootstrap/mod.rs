//! The programs that build the embedded defaults and show them: pretraining a small GPT-2
//! (`pretrain`) or a tiny Qwen2-VL (`pretrain_vl`) from scratch, the text default and its
//! demo (`demo`), the multimodal default and `demo --multimodal` (`demo_vl`).
pub mod demo;
pub mod demo_vl;
pub mod pretrain;
pub mod pretrain_vl;
