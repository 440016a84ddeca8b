#!/bin/bash
cd /app
printf '%s\n' \
  'CC = gcc' \
  'CFLAGS = -O2 -Wall' \
  'OBJS = src/main.o src/vec.o' \
  '' \
  'vecdemo: $(OBJS)' \
  '	$(CC) $(CFLAGS) -o $@ $(OBJS) -lm' \
  '' \
  'src/%.o: src/%.c src/vec.h' \
  '	$(CC) $(CFLAGS) -c -o $@ $<' \
  '' \
  'clean:' \
  '	rm -f vecdemo $(OBJS)' \
  '' \
  '.PHONY: clean' > Makefile
make
