//! `dualedit demo [--multimodal]`: the embedded defaults shown.
use crate::bootstrap::{demo, demo_vl};
use crate::cli::args::DemoArgs;

pub fn run(a: DemoArgs) -> anyhow::Result<()> {
    let plan = a.devices.plan()?;
    let root = a.root.unwrap_or_else(demo::shipped_root);
    if a.multimodal {
        let s = demo_vl::run_demo_vl(&demo_vl::vl_root(&root), plan, a.json, &mut std::io::stdout())?;
        if !a.json {
            println!("\ndone in {:.1} s", s.seconds);
        }
        return Ok(());
    }
    let s = demo::run_demo(&root, plan, a.show, &mut std::io::stdout())?;
    println!("\ndone in {:.1} s", s.seconds);
    Ok(())
}
