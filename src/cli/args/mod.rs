//! The flags of each command (clap derive), one file per command; the flags several
//! commands share (`MethodArgs`; the library's `run::options` types) once.
mod build_default;
mod common;
mod compare;
mod config;
mod convert;
mod demo;
mod edit;
mod eval;
mod plan;
mod pretrain;
mod report;
mod score;
mod serve;
mod stats;
mod train;
mod world;

pub use build_default::BuildDefaultArgs;
pub use common::MethodArgs;
pub use crate::data::easyedit::dataset_parser as dataset;
pub use crate::model::vision::parse_image_size;
pub use compare::CompareCmd;
pub use config::ConfigArgs;
pub use convert::ConvertArgs;
pub use demo::DemoArgs;
pub use edit::EditArgs;
pub use eval::EvalArgs;
pub use plan::PlanArgs;
pub use pretrain::PretrainArgs;
pub use report::ReportCmd;
pub use score::ScoreArgs;
pub use serve::ServeArgs;
pub use stats::StatsArgs;
pub use train::TrainArgs;
pub use world::WorldArgs;
