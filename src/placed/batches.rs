//! Batches as the runtime runs them: padded on the main device, with the frozen vision
//! tower's features of their images.
use super::Placed;
use crate::data::multimodal::StepImages;
use crate::data::{Example, TokenBatch};
use crate::model::ParamView;
use crate::{Error, Result};

impl Placed {

    /// One padded batch of `examples` on the main device, where the capture and the
    /// unedited forwards run (the mover takes it to the sub-device for edited forwards),
    /// with the features of the examples' images (computed here; use
    /// [`Placed::images`] + [`Placed::collate_with`] to share them between batches).
    pub fn collate(&self, examples: &[&Example]) -> Result<TokenBatch> {
        let images = self.images(examples)?;
        self.collate_with(examples, images.as_ref())
    }


    /// [`Placed::collate`] with image features computed beforehand by [`Placed::images`].
    pub fn collate_with(&self, examples: &[&Example], images: Option<&StepImages>) -> Result<TokenBatch> {
        let pad = self.lm.tokenizer.pad_id();
        match images {
            Some(im) => im.collate(examples, pad, self.plan.main),
            None if examples.iter().any(|e| e.image.is_some()) => Err(Error::input("examples show images but no image features were computed")),
            None => Ok(TokenBatch::collate(examples, pad, self.plan.main)),
        }
    }


    /// The frozen vision tower's features of every distinct image of `examples`, once
    /// each, on the main device (`None` without images). A text-only model refuses images.
    pub fn images(&self, examples: &[&Example]) -> Result<Option<StepImages<'_>>> {
        if examples.iter().all(|e| e.image.is_none()) {
            return Ok(None);
        }
        match (self.lm.model.family().vision_language(), &self.image_proc) {
            (Some(vl), Some(proc)) => StepImages::compute(vl, &ParamView::frozen(&self.lm.params), proc, examples),
            _ => Err(Error::input(format!(
                "{} is a text-only model ({}); images need a Qwen2-VL or Qwen2.5-VL model",
                self.lm.dir.display(),
                self.lm.model.info().architecture
            ))),
        }
    }
}
