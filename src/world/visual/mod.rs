//! A synthetic *visual* world beside the text one ([`super::text`]): scenes of a few
//! coloured shapes drawn in code, questions about them, and EasyEdit E-VQA records with
//! counterfactual answers, for a tiny Qwen2-VL-shaped model and its MEND editor (issue #22).
//!
//! Why synthetic: a tiny vision-language model pretrained on a CPU can only be asked to
//! know what it can learn in minutes. Flat shapes in a handful of pure colours, each at one
//! of five places, are learnable by a small vision tower, and every answer is a pure
//! function of the scene description, so tests can re-derive it.
//!
//! Why this layout (measured, docs/notebook/vision-language.md "The multimodal default"): every
//! object sits centred in its own cell of Qwen2-VL's merged-token grid (28 × 28 pixels: one
//! image token), the five places are the cells of a cross on an odd grid (3 × 3 by default),
//! and every question names what it is about by a shape, a colour or a place and asks for a
//! colour or a shape. An earlier world (objects at jittered positions straddling token borders;
//! questions asking *where* a shape is and *how many* there are) was not learned by a 366
//! k-parameter Qwen2-VL in 6 000 steps, in dualedit or in transformers: its answers stayed
//! image-blind. Where and how many need an object's place or a count in the content of image
//! tokens, which a tower without absolute positions does not put there.
//!
//! A scene is drawn twice: the *original* image, and the *rephrase* image EasyEdit asks
//! for (the same objects in the same cells, rescaled about their centres, on another
//! background), which tests whether an edit generalises to another picture of the same
//! scene.
//!
//! Files written by [`write_visual_world`] into one folder, which is both EasyEdit's image
//! root and its rephrase-image root:
//!
//! - `images/scene-NNNN.png`, `images_rephrase/scene-NNNN.png`: the two renders;
//! - `vqa-train.json`, `vqa-holdout.json`: E-VQA records (`src`, `pred`, `alt`,
//!   `rephrase`, `image`, `image_rephrase`, `loc`, `loc_ans`, `m_loc`, `m_loc_q`,
//!   `m_loc_a`), whole scenes on one side, so no (scene, question) pair is in both;
//! - `pretrain.json`: what a model must know, as [`PretrainCorpus`]: every question in
//!   every phrasing on both renders of every scene, with its true answer, and the
//!   NQ-style text facts the records' `loc` questions ask;
//! - `scenes.json`: the configuration and scene descriptions (it also marks the folder
//!   as a visual world, which a later build may overwrite).
//!
//! Answers are single words (`red`, `square`), as a model prompted with
//! EasyEdit's `Question: {q} Short answer:` would give them. Everything is a pure function
//! of [`VisualWorldConfig`] through [`SplitMix64`] streams, so a seed gives byte-identical
//! files on every machine.
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use image::{ImageEncoder, Rgb, RgbImage};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::rng::SplitMix64;
use crate::{Error, Result};

// ---------------------------------------------------------------------------------------
// Configuration
// ---------------------------------------------------------------------------------------

/// Qwen2-VL's resize grid (patch 14 × merge 2), the side of one image token's cell: image
/// sides that are multiples of it reach the vision tower unresized, so the pixels a test
/// checks are the pixels the model sees, and an object centred in a cell is one token.
pub const GRID: u32 = 28;
/// Largest side accepted (15 cells): a tiny model's world has no use for more image tokens.
pub const MAX_SIDE: u32 = 420;
/// Five places an object can be: at most five objects per scene.
pub const MAX_OBJECTS: usize = 5;

/// What visual world to generate.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VisualWorldConfig {
    pub seed: u64,
    /// Image width and height in pixels: odd multiples of [`GRID`] (3, 5, … cells, so the
    /// grid has a middle row and column), from 84 to [`MAX_SIDE`].
    pub width: u32,
    pub height: u32,
    /// Scenes whose records train the editor, and scenes whose records are held out.
    /// Each split has none or at least two (an image-locality record shows another scene
    /// of its own split).
    pub n_train_scenes: usize,
    pub n_holdout_scenes: usize,
    /// Objects per scene, drawn uniformly from `min_objects..=max_objects`.
    pub min_objects: usize,
    pub max_objects: usize,
}

impl Default for VisualWorldConfig {
    /// 84 × 84 pixels are 6 × 6 patches, 3 × 3 image tokens after the 2 × 2 merge. 250
    /// scenes of 2–4 objects give about 2 000 train and 500 held-out records (about 10 per
    /// scene) and about 10 000 pretraining triples (each question in its two phrasings, on
    /// both renders); it builds in a second.
    fn default() -> Self {
        Self { seed: 7, width: 84, height: 84, n_train_scenes: 200, n_holdout_scenes: 50, min_objects: 2, max_objects: 4 }
    }
}

impl VisualWorldConfig {
    /// Refuses sizes off Qwen2-VL's grid and object or scene counts the generator cannot
    /// honour, naming the value.
    pub fn validate(&self) -> Result<()> {
        for (name, side) in [("width", self.width), ("height", self.height)] {
            if !side.is_multiple_of(GRID) || (side / GRID).is_multiple_of(2) || !(3 * GRID..=MAX_SIDE).contains(&side) {
                return Err(Error::input(format!(
                    "visual world {name} {side}: must be an odd multiple of {GRID} (Qwen2-VL's merged-token cell; odd, so the grid has a middle) from {} to {MAX_SIDE}",
                    3 * GRID
                )));
            }
        }
        if self.min_objects == 0 || self.min_objects > self.max_objects || self.max_objects > MAX_OBJECTS {
            return Err(Error::input(format!(
                "visual world objects per scene {}..={}: need 1 <= min <= max <= {MAX_OBJECTS}",
                self.min_objects, self.max_objects
            )));
        }
        for (name, n) in [("training", self.n_train_scenes), ("held-out", self.n_holdout_scenes)] {
            if n == 1 {
                return Err(Error::input(format!(
                    "visual world: 1 {name} scene; a split needs none or at least 2 (image locality shows another scene of the split)"
                )));
            }
        }
        if self.n_train_scenes + self.n_holdout_scenes == 0 {
            return Err(Error::input("visual world: no scenes asked for"));
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------
// Vocabulary
// ---------------------------------------------------------------------------------------

/// Object shapes. They differ in *where* in their cell the colour lies (all of it, a small
/// middle, a horizontal or vertical band, both bands), which a 14-pixel patch's linear
/// embedding separates from the start; shapes that differ only along their outlines
/// (circle, diamond, triangle) were not told apart by the tiny tower in the runs tried
/// (docs/notebook/vision-language.md, "The multimodal default").
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Shape {
    Dot,
    Square,
    Bar,
    Pillar,
    Cross,
}

impl Shape {
    pub const ALL: [Shape; 5] = [Shape::Dot, Shape::Square, Shape::Bar, Shape::Pillar, Shape::Cross];

    pub fn name(self) -> &'static str {
        match self {
            Shape::Dot => "dot",
            Shape::Square => "square",
            Shape::Bar => "bar",
            Shape::Pillar => "pillar",
            Shape::Cross => "cross",
        }
    }

    /// Whether the offset `(dx, dy)` from the centre lies in the shape of radius `r`. Every
    /// shape holds its centre (the centre pixel carries the object's colour) and none
    /// reaches beyond `r` on either axis.
    fn contains(self, dx: f64, dy: f64, r: f64) -> bool {
        let (ax, ay) = (dx.abs(), dy.abs());
        let (bar, pillar) = (ax <= r && ay <= r / 3.0, ay <= r && ax <= r / 3.0);
        match self {
            Shape::Dot => dx * dx + dy * dy <= 0.2 * r * r,
            Shape::Square => ax.max(ay) <= r,
            Shape::Bar => bar,
            Shape::Pillar => pillar,
            Shape::Cross => bar || pillar,
        }
    }
}

/// Object colours: saturated, far from each other and from every [`Background`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Colour {
    Red,
    Green,
    Blue,
    Yellow,
    Purple,
    Orange,
}

impl Colour {
    pub const ALL: [Colour; 6] = [Colour::Red, Colour::Green, Colour::Blue, Colour::Yellow, Colour::Purple, Colour::Orange];

    pub fn name(self) -> &'static str {
        match self {
            Colour::Red => "red",
            Colour::Green => "green",
            Colour::Blue => "blue",
            Colour::Yellow => "yellow",
            Colour::Purple => "purple",
            Colour::Orange => "orange",
        }
    }

    pub fn rgb(self) -> [u8; 3] {
        match self {
            Colour::Red => [220, 30, 30],
            Colour::Green => [30, 160, 50],
            Colour::Blue => [30, 70, 220],
            Colour::Yellow => [240, 210, 30],
            Colour::Purple => [140, 50, 180],
            Colour::Orange => [245, 130, 20],
        }
    }
}

/// Canvas colours: neutral, so an object never blends into the background.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Background {
    White,
    LightGrey,
    DarkGrey,
    Black,
    Beige,
}

impl Background {
    pub const ALL: [Background; 5] = [Background::White, Background::LightGrey, Background::DarkGrey, Background::Black, Background::Beige];

    pub fn rgb(self) -> [u8; 3] {
        match self {
            Background::White => [255, 255, 255],
            Background::LightGrey => [200, 200, 200],
            Background::DarkGrey => [70, 70, 70],
            Background::Black => [0, 0, 0],
            Background::Beige => [230, 220, 190],
        }
    }
}

/// Where an object sits: one of five cells (the middle of each edge of the grid, and its
/// centre), at most one object each.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Position {
    Left,
    Right,
    Top,
    Bottom,
    Centre,
}

impl Position {
    pub const ALL: [Position; 5] = [Position::Left, Position::Right, Position::Top, Position::Bottom, Position::Centre];

    /// How a question names the place: "What colour is the object on the left?".
    pub fn phrase(self) -> &'static str {
        match self {
            Position::Left => "on the left",
            Position::Right => "on the right",
            Position::Top => "at the top",
            Position::Bottom => "at the bottom",
            Position::Centre => "in the centre",
        }
    }

    /// The place's cell `(column, row)` on a grid of `cols × rows` cells (both odd).
    pub fn cell(self, cols: u32, rows: u32) -> (u32, u32) {
        let (mc, mr) = (cols / 2, rows / 2);
        match self {
            Position::Left => (0, mr),
            Position::Right => (cols - 1, mr),
            Position::Top => (mc, 0),
            Position::Bottom => (mc, rows - 1),
            Position::Centre => (mc, mr),
        }
    }
}

/// NQ-style text questions with fixed answers: the records' text locality (`loc`,
/// `loc_ans`), prefixed as E-VQA's are. They are in the pretraining corpus, so a model
/// knows them and an edit that changes them has leaked. Some answers are words the
/// images' answers use too (colours), which makes locality a real test.
pub const NQ_FACTS: &[(&str, &str)] = &[
    ("nq question: who wrote romeo and juliet", "william shakespeare"),
    ("nq question: what is the capital of france", "paris"),
    ("nq question: how many days are there in a week", "seven"),
    ("nq question: how many legs does a spider have", "eight"),
    ("nq question: what is the largest planet in the solar system", "jupiter"),
    ("nq question: what gas do plants take from the air", "carbon dioxide"),
    ("nq question: who painted the mona lisa", "leonardo da vinci"),
    ("nq question: what is the chemical symbol for gold", "au"),
    ("nq question: what colour is a ripe banana", "yellow"),
    ("nq question: what is the longest river in africa", "the nile"),
    ("nq question: in which country is the eiffel tower", "france"),
    ("nq question: who was the first person to walk on the moon", "neil armstrong"),
    ("nq question: what is the smallest prime number", "two"),
    ("nq question: how many sides does a hexagon have", "six"),
    ("nq question: what is the hardest natural substance", "diamond"),
    ("nq question: which planet is known as the red planet", "mars"),
    ("nq question: what language is spoken in brazil", "portuguese"),
    ("nq question: what is the currency of japan", "yen"),
    ("nq question: who developed the theory of relativity", "albert einstein"),
    ("nq question: what is the tallest mountain in the world", "mount everest"),
    ("nq question: how many players are on a football team", "eleven"),
    ("nq question: what is the main ingredient of guacamole", "avocado"),
    ("nq question: which ocean is the largest", "the pacific"),
    ("nq question: in what year did the second world war end", "1945"),
    ("nq question: what is the capital of japan", "tokyo"),
    ("nq question: who wrote the odyssey", "homer"),
    ("nq question: how many strings does a violin have", "four"),
    ("nq question: what colour is chlorophyll", "green"),
    ("nq question: what is the boiling point of water in celsius", "100 degrees"),
    ("nq question: which animal is known as the king of the jungle", "the lion"),
];

// ---------------------------------------------------------------------------------------
// Scenes
// ---------------------------------------------------------------------------------------

/// One object, centred in its place's cell. `size` is its radius as a fraction of the
/// cell's side.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Object {
    pub shape: Shape,
    pub colour: Colour,
    pub position: Position,
    pub size: f64,
}

/// How a scene is drawn: background, and the objects' scale about their cells' centres.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct View {
    pub background: Background,
    pub scale: f64,
}

/// Which of a scene's two images.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Render {
    Original,
    Rephrase,
}

impl Render {
    /// The folder of this render's images inside the world folder.
    pub fn folder(self) -> &'static str {
        match self {
            Render::Original => "images",
            Render::Rephrase => "images_rephrase",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Scene {
    pub id: usize,
    pub objects: Vec<Object>,
    pub original: View,
    pub rephrase: View,
}

// Geometry, in fractions of a cell's side. One size for every object and one scale for
// every rephrase render: with sizes drawn from 0.36–0.44 and scales from 0.70–0.80 the
// tiny model had learned about 60 % of the answers after 6 000 steps, with these two
// sizes all of them (docs/notebook/vision-language.md). The radius keeps every shape inside its
// cell with two pixels to spare, so no object touches another cell.
/// An object's radius: 0.43 of the cell's side (12 pixels in a 28-pixel cell).
const SIZE: f64 = 0.43;
/// The rephrase render's objects are drawn at this share of their size (9 pixels).
const REPHRASE_SCALE: f64 = 0.75;

impl Scene {
    /// Centre (x, y) and radius in pixels of object `i` in `render`, on a `width` ×
    /// `height` canvas.
    pub fn placement(&self, i: usize, render: Render, width: u32, height: u32) -> (f64, f64, f64) {
        let o = &self.objects[i];
        let (col, row) = o.position.cell(width / GRID, height / GRID);
        let cell = GRID as f64;
        ((col as f64 + 0.5) * cell, (row as f64 + 0.5) * cell, self.view(render).scale * o.size * cell)
    }

    pub fn view(&self, render: Render) -> &View {
        match render {
            Render::Original => &self.original,
            Render::Rephrase => &self.rephrase,
        }
    }

    /// Draws the scene: plain rasterisation, one pure colour per object, no
    /// anti-aliasing (a pixel belongs to a shape when its centre does), so every object
    /// pixel has exactly its palette colour.
    pub fn render(&self, render: Render, width: u32, height: u32) -> RgbImage {
        let mut img = RgbImage::from_pixel(width, height, Rgb(self.view(render).background.rgb()));
        for (i, o) in self.objects.iter().enumerate() {
            let (cx, cy, r) = self.placement(i, render, width, height);
            let colour = Rgb(o.colour.rgb());
            let span = |c: f64, side: u32| ((c - r - 1.0).floor().max(0.0) as u32, ((c + r + 1.0).ceil().max(0.0) as u32).min(side));
            let ((x0, x1), (y0, y1)) = (span(cx, width), span(cy, height));
            for y in y0..y1 {
                for x in x0..x1 {
                    if o.shape.contains(x as f64 + 0.5 - cx, y as f64 + 0.5 - cy, r) {
                        img.put_pixel(x, y, colour);
                    }
                }
            }
        }
        img
    }

    /// The questions this scene answers unambiguously, in a fixed order: per object (in
    /// scene order) its colour and shape by its place; per shape worn by one object, that
    /// object's colour; per colour worn by one object, that object's shape.
    pub fn questions(&self) -> Vec<Question> {
        let mut out = Vec::new();
        for o in &self.objects {
            out.push(Question::ask(QuestionKind::PlaceColour, o.position.phrase(), o.colour.name()));
            out.push(Question::ask(QuestionKind::PlaceShape, o.position.phrase(), o.shape.name()));
        }
        for shape in Shape::ALL {
            if let [o] = self.objects.iter().filter(|o| o.shape == shape).collect::<Vec<_>>()[..] {
                out.push(Question::ask(QuestionKind::Colour, shape.name(), o.colour.name()));
            }
        }
        for colour in Colour::ALL {
            if let [o] = self.objects.iter().filter(|o| o.colour == colour).collect::<Vec<_>>()[..] {
                out.push(Question::ask(QuestionKind::Shape, colour.name(), o.shape.name()));
            }
        }
        out
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QuestionKind {
    /// "What colour is the bar?" (a shape worn once) -> a colour.
    Colour,
    /// "Which shape is red?" (a colour worn once) -> a shape.
    Shape,
    /// "What colour is the object on the left?" -> a colour.
    PlaceColour,
    /// "Which shape is at the top?" -> a shape.
    PlaceShape,
}

impl QuestionKind {
    pub const ALL: [QuestionKind; 4] = [QuestionKind::Colour, QuestionKind::Shape, QuestionKind::PlaceColour, QuestionKind::PlaceShape];

    /// Phrasings with `{x}` for the shape, colour or place asked about: the canonical one
    /// (a record's `src`) and its rephrasing. No phrasing of one kind reads as another
    /// kind's with a word of its subject vocabulary. Two phrasings that name the subject
    /// where the canonical one does: with a third that names it last ("The object on the
    /// left has which shape?") the tiny model had learned half as much after 2 500 steps
    /// (docs/notebook/vision-language.md).
    pub fn templates(self) -> &'static [&'static str] {
        match self {
            QuestionKind::Colour => &["What colour is the {x}?", "Which colour does the {x} have?"],
            QuestionKind::Shape => &["Which shape is {x}?", "What shape is the {x} object?"],
            QuestionKind::PlaceColour => &["What colour is the object {x}?", "Which colour does the object {x} have?"],
            QuestionKind::PlaceShape => &["Which shape is {x}?", "What shape is the object {x}?"],
        }
    }

    /// Every answer a question of this kind can have, so a counterfactual is of its type.
    pub fn vocabulary(self) -> Vec<&'static str> {
        match self {
            QuestionKind::Colour | QuestionKind::PlaceColour => Colour::ALL.iter().map(|c| c.name()).collect(),
            QuestionKind::Shape | QuestionKind::PlaceShape => Shape::ALL.iter().map(|s| s.name()).collect(),
        }
    }

    /// Every word or phrase a question of this kind can be about (`{x}`).
    pub fn subjects(self) -> Vec<&'static str> {
        match self {
            QuestionKind::Colour => Shape::ALL.iter().map(|s| s.name()).collect(),
            QuestionKind::Shape => Colour::ALL.iter().map(|c| c.name()).collect(),
            QuestionKind::PlaceColour | QuestionKind::PlaceShape => Position::ALL.iter().map(|p| p.phrase()).collect(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Question {
    pub kind: QuestionKind,
    /// What the question is about: a shape, a colour or a place's phrase.
    pub about: String,
    pub answer: String,
    /// Every phrasing, canonical first.
    pub phrasings: Vec<String>,
}

impl Question {
    fn ask(kind: QuestionKind, about: &str, answer: &str) -> Question {
        Question {
            kind,
            about: about.to_string(),
            answer: answer.to_string(),
            phrasings: kind.templates().iter().map(|t| t.replace("{x}", about)).collect(),
        }
    }
}

/// Relative path of a scene's image under the world folder.
pub fn image_path(id: usize, render: Render) -> String {
    format!("{}/scene-{id:04}.png", render.folder())
}

// ---------------------------------------------------------------------------------------
// Generation
// ---------------------------------------------------------------------------------------

const STREAM_SCENES: u64 = 1;
const STREAM_RECORDS: u64 = 2;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VisualWorld {
    pub config: VisualWorldConfig,
    /// Training scenes first (`config.n_train_scenes`), then held-out ones; `id` = index.
    pub scenes: Vec<Scene>,
}

/// One thing a model must know: the answer to a question about an image.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Triple {
    /// Relative to the world folder.
    pub image: String,
    pub question: String,
    pub answer: String,
}

/// A text-only fact (the NQ-style locality questions).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TextFact {
    pub question: String,
    pub answer: String,
}

/// `pretrain.json`: what the tiny VL model is pretrained on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PretrainCorpus {
    pub image_size: [u32; 2],
    pub vqa: Vec<Triple>,
    pub text: Vec<TextFact>,
}

impl VisualWorld {
    /// The world `cfg` describes; equal configs give equal worlds.
    pub fn generate(cfg: &VisualWorldConfig) -> Result<VisualWorld> {
        cfg.validate()?;
        let mut rng = SplitMix64::new(cfg.seed, STREAM_SCENES);
        let n = cfg.n_train_scenes + cfg.n_holdout_scenes;
        let scenes = (0..n)
            .map(|id| {
                let k = cfg.min_objects + rng.below(cfg.max_objects - cfg.min_objects + 1);
                let mut slots = Position::ALL.to_vec();
                rng.shuffle(&mut slots);
                // A shape or a colour may repeat within a scene;
                // questions are only asked where the scene answers them unambiguously.
                let objects = slots[..k]
                    .iter()
                    .map(|&position| Object {
                        shape: *rng.pick(&Shape::ALL),
                        colour: *rng.pick(&Colour::ALL),
                        position,
                        size: SIZE,
                    })
                    .collect();
                let background = *rng.pick(&Background::ALL);
                let others: Vec<Background> = Background::ALL.into_iter().filter(|b| *b != background).collect();
                let rephrase = View { background: *rng.pick(&others), scale: REPHRASE_SCALE };
                Scene { id, objects, original: View { background, scale: 1.0 }, rephrase }
            })
            .collect();
        Ok(VisualWorld { config: cfg.clone(), scenes })
    }

    pub fn train_scenes(&self) -> &[Scene] {
        &self.scenes[..self.config.n_train_scenes.min(self.scenes.len())]
    }

    pub fn holdout_scenes(&self) -> &[Scene] {
        &self.scenes[self.config.n_train_scenes.min(self.scenes.len())..]
    }

    /// Per kind, the answers some question of the world really has: a counterfactual is
    /// drawn from these, so it is of the question's type and a word the model has seen
    /// as an answer (as the text world draws `target_new` from its pools).
    pub fn answer_pools(&self) -> BTreeMap<QuestionKind, Vec<String>> {
        let mut pools: BTreeMap<QuestionKind, BTreeSet<String>> = BTreeMap::new();
        for q in self.scenes.iter().flat_map(Scene::questions) {
            pools.entry(q.kind).or_default().insert(q.answer);
        }
        pools.into_iter().map(|(k, v)| (k, v.into_iter().collect())).collect()
    }

    /// (train, held-out) E-VQA records: one per question of each scene of the split, in a
    /// shuffled order. `pred` is the true answer, `alt` another answer of the same kind,
    /// `rephrase` another phrasing, `m_loc` another scene of the same split with one of its
    /// questions. A question whose kind has a single answer in the whole world (possible
    /// only in a tiny world) cannot be edited to anything and yields no record.
    pub fn records(&self) -> (Vec<Value>, Vec<Value>) {
        let mut rng = SplitMix64::new(self.config.seed, STREAM_RECORDS);
        let pools = self.answer_pools();
        let train = split_records(&mut rng, self.train_scenes(), &pools);
        let holdout = split_records(&mut rng, self.holdout_scenes(), &pools);
        (train, holdout)
    }

    /// Every question in every phrasing on both renders of every scene, and the text facts.
    pub fn pretrain_corpus(&self) -> PretrainCorpus {
        let mut vqa = Vec::new();
        for scene in &self.scenes {
            let questions = scene.questions();
            for render in [Render::Original, Render::Rephrase] {
                for q in &questions {
                    for p in &q.phrasings {
                        vqa.push(Triple { image: image_path(scene.id, render), question: p.clone(), answer: q.answer.clone() });
                    }
                }
            }
        }
        let text = NQ_FACTS.iter().map(|(q, a)| TextFact { question: q.to_string(), answer: a.to_string() }).collect();
        PretrainCorpus { image_size: [self.config.width, self.config.height], vqa, text }
    }

    /// The world described by `dir/scenes.json`, as [`write_visual_world`] wrote it.
    pub fn read(dir: &Path) -> Result<VisualWorld> {
        let path = dir.join(SCENES_FILE);
        let text = crate::io::read_text(&path)?;
        // The format first: an older world's scenes would otherwise fail on a shape or a
        // field this version no longer has, which says nothing about rebuilding.
        match scene_file_format(&text) {
            Some(f) if f == FORMAT => {}
            Some(f) => return Err(Error::file(&path, format!("format {f:?}, expected {FORMAT:?}: rebuild it with `dualedit world --vl`"))),
            None => return Err(Error::file(&path, "not a visual world's scene file (no `format` field)")),
        }
        let file: SceneFile = serde_json::from_str(&text).map_err(|e| Error::file(&path, format!("not a visual world's scene file: {e}")))?;
        file.config.validate().map_err(|e| Error::file(&path, e.to_string()))?;
        Ok(VisualWorld { config: file.config, scenes: file.scenes })
    }
}

fn split_records(rng: &mut SplitMix64, scenes: &[Scene], pools: &BTreeMap<QuestionKind, Vec<String>>) -> Vec<Value> {
    let mut out = Vec::new();
    for (i, scene) in scenes.iter().enumerate() {
        for q in scene.questions() {
            let others: Vec<&String> = pools.get(&q.kind).into_iter().flatten().filter(|a| **a != q.answer).collect();
            if others.is_empty() {
                continue;
            }
            let alt = *rng.pick(&others);
            let rephrase = &q.phrasings[1 + rng.below(q.phrasings.len() - 1)];
            let (loc, loc_ans) = *rng.pick(NQ_FACTS);
            // Validation keeps a non-empty split at two scenes or more, and every scene
            // has a question (the colour of the object in any of its cells).
            let other = &scenes[(i + 1 + rng.below(scenes.len() - 1)) % scenes.len()];
            let other_questions = other.questions();
            let m = rng.pick(&other_questions);
            out.push(json!({
                "src": q.phrasings[0],
                "pred": q.answer,
                "alt": alt,
                "rephrase": rephrase,
                "image": image_path(scene.id, Render::Original),
                "image_rephrase": image_path(scene.id, Render::Rephrase),
                "loc": loc,
                "loc_ans": loc_ans,
                "m_loc": image_path(other.id, Render::Original),
                "m_loc_q": m.phrasings[0],
                "m_loc_a": m.answer,
            }));
        }
    }
    rng.shuffle(&mut out);
    out
}

// ---------------------------------------------------------------------------------------
// Writing
// ---------------------------------------------------------------------------------------

pub const SCENES_FILE: &str = "scenes.json";
/// Version 2: objects one per merged-token cell, place questions (no counts, no "where").
const FORMAT: &str = "dualedit-visual-world/2";
const FORMAT_PREFIX: &str = "dualedit-visual-world/";

#[derive(Serialize, Deserialize)]
struct SceneFile {
    format: String,
    config: VisualWorldConfig,
    scenes: Vec<Scene>,
}

/// What [`write_visual_world`] wrote.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct WrittenWorld {
    pub dir: std::path::PathBuf,
    pub scenes: usize,
    pub image_size: [u32; 2],
    pub train_records: usize,
    pub holdout_records: usize,
    pub pretrain_triples: usize,
    pub text_facts: usize,
}

/// A new or empty folder, or one holding a visual world (its `scenes.json`): anything else
/// is someone's files, which a rebuild must not mix with scenes or overwrite.
fn check_target(dir: &Path) -> Result<()> {
    let mut entries = match std::fs::read_dir(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::io(dir, e)),
        Ok(entries) => entries,
    };
    if entries.next().is_none() {
        return Ok(());
    }
    if !dir.join(SCENES_FILE).is_file() {
        return Err(Error::file(dir, format!("is not empty and holds no visual world ({SCENES_FILE}): refusing to write into it; name a new or empty folder")));
    }
    // Any version of this format is ours to rewrite (a rebuild replaces an older world).
    let path = dir.join(SCENES_FILE);
    let ours = scene_file_format(&crate::io::read_text(&path)?).is_some_and(|f| f.starts_with(FORMAT_PREFIX));
    if ours {
        return Ok(());
    }
    Err(Error::file(dir, format!("is not empty and not a visual world ({} is not a {FORMAT_PREFIX}* file); refusing to write into it", path.display())))
}

/// The `format` field of a scene file's text, if it is a JSON object with one.
fn scene_file_format(text: &str) -> Option<String> {
    #[derive(Deserialize)]
    struct Format {
        format: String,
    }
    serde_json::from_str::<Format>(text).ok().map(|f| f.format)
}

fn write_json(path: &Path, value: &impl Serialize) -> Result<()> {
    let mut text = serde_json::to_string_pretty(value).map_err(|e| Error::file(path, e.to_string()))?;
    text.push('\n');
    crate::io::write_atomic(path, text.as_bytes())
}

/// PNG bytes of `img` (8-bit RGB, the encoder's default compression and filter: the same
/// bytes for the same pixels with a given `image` crate version).
pub fn encode_png(img: &RgbImage, path: &Path) -> Result<Vec<u8>> {
    let mut bytes = Vec::new();
    image::codecs::png::PngEncoder::new(&mut bytes)
        .write_image(img.as_raw(), img.width(), img.height(), image::ColorType::Rgb8)
        .map_err(|e| Error::file(path, format!("encoding PNG: {e}")))?;
    Ok(bytes)
}

/// Writes the world's files into `dir` (see the module docs), each atomically. The scene
/// file goes first (so an interrupted build leaves a folder a rerun may overwrite), then
/// the images, then the records (so a reader of a fresh build never finds a record whose
/// image is missing). Images of an earlier, larger world in the same folder are removed.
pub fn write_visual_world(dir: &Path, world: &VisualWorld) -> Result<WrittenWorld> {
    check_target(dir)?;
    let cfg = &world.config;
    write_json(&dir.join(SCENES_FILE), &SceneFile { format: FORMAT.to_string(), config: cfg.clone(), scenes: world.scenes.clone() })?;
    for render in [Render::Original, Render::Rephrase] {
        let mut written = BTreeSet::new();
        for scene in &world.scenes {
            let rel = image_path(scene.id, render);
            let path = dir.join(&rel);
            crate::io::write_atomic(&path, &encode_png(&scene.render(render, cfg.width, cfg.height), &path)?)?;
            written.insert(rel);
        }
        let folder = dir.join(render.folder());
        for entry in std::fs::read_dir(&folder).map_err(|e| Error::io(&folder, e))? {
            let entry = entry.map_err(|e| Error::io(&folder, e))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let ours = name.starts_with("scene-") && name.ends_with(".png");
            if ours && !written.contains(&format!("{}/{name}", render.folder())) {
                std::fs::remove_file(entry.path()).map_err(|e| Error::io(entry.path(), e))?;
            }
        }
    }
    let corpus = world.pretrain_corpus();
    write_json(&dir.join("pretrain.json"), &corpus)?;
    let (train, holdout) = world.records();
    write_json(&dir.join("vqa-train.json"), &train)?;
    write_json(&dir.join("vqa-holdout.json"), &holdout)?;
    Ok(WrittenWorld {
        dir: dir.to_path_buf(),
        scenes: world.scenes.len(),
        image_size: [cfg.width, cfg.height],
        train_records: train.len(),
        holdout_records: holdout.len(),
        pretrain_triples: corpus.vqa.len(),
        text_facts: corpus.text.len(),
    })
}

#[cfg(test)]
mod tests;
