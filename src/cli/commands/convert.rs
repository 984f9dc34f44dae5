//! `dualedit convert`: a GGUF file imported as a Hugging Face folder ([`crate::convert`]).
use crate::cli::args::ConvertArgs;

pub fn run(a: ConvertArgs) -> anyhow::Result<()> {
    let start = std::time::Instant::now();
    let s = crate::convert::convert_gguf(&a.gguf, &a.out)?;
    let seconds = start.elapsed().as_secs_f64();
    if a.json {
        let mut v = serde_json::to_value(&s)?;
        v["seconds"] = seconds.into();
        println!("{v}");
    } else {
        let types: Vec<String> = s.types.iter().map(|(t, n)| format!("{n} {t}")).collect();
        println!(
            "{} ({} tensors: {}; {} parameters, vocabulary {}{}) written to {} as f32 in {seconds:.1} s",
            s.architecture,
            s.tensors,
            types.join(", "),
            s.parameters,
            s.vocab_size,
            if s.tie_word_embeddings { ", head tied to the embedding" } else { "" },
            s.out.display()
        );
        if !s.skipped.is_empty() {
            println!("not converted (transformers does not load them either): {}", s.skipped.join(", "));
        }
    }
    Ok(())
}
