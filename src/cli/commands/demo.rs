//! `dualedit demo [--multimodal | --real]`: the defaults shown.
use crate::bootstrap::{demo, demo_vl};
use crate::cli::args::DemoArgs;

pub fn run(a: DemoArgs) -> anyhow::Result<()> {
    let plan = a.devices.plan()?;
    if a.multimodal {
        let root = a.root.unwrap_or_else(demo::shipped_root);
        let s = demo_vl::run_demo_vl(&demo_vl::vl_root(&root), plan, a.json, &mut std::io::stdout())?;
        if !a.json {
            println!("\ndone in {:.1} s", s.seconds);
        }
        return Ok(());
    }
    let (set, shown) = if a.real {
        (demo::DemoSet::real(&a.root.unwrap_or_else(demo::real_root))?, a.show.max(5))
    } else {
        (demo::DemoSet::embedded(&a.root.unwrap_or_else(demo::shipped_root)), a.show)
    };
    let s = demo::run_demo(&set, plan, shown, &mut std::io::stdout())?;
    println!("\ndone in {:.1} s", s.seconds);
    Ok(())
}
