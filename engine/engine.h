/*
 * engine.h - engine/ in one include: model files, tokenizer, model and
 * weight versions, runtime, scheduler (each subfolder's own header says
 * what it offers, owns and may touch).
 */
#ifndef QL_ENGINE_H
#define QL_ENGINE_H

#include "modelfile.h"
#include "tokenizer.h"
#include "model.h"
#include "runtime.h"
#include "scheduler.h"

#include <stdio.h>

#endif
